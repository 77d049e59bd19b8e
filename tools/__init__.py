"""Command lines: benchmarks, the replay, the load test, the tree-tab stall check, llama.cpp and GPU helpers. Built on engine/, components/ and server/; nothing imports them."""
