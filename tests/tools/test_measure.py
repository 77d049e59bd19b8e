"""tools.measure.run_clients: the closed loop's clock starts once every client is ready."""

from __future__ import annotations

import threading
import time

from tools.measure import run_clients


def test_what_clients_prepare_is_off_the_clock_and_each_gets_its_own():
    made, used = [], []
    lock = threading.Lock()

    def prepare() -> object:
        time.sleep(0.3)  # an HTTP client's TLS context, say
        thing = object()
        with lock:
            made.append(thing)
        return thing

    def client(thing: object) -> None:
        time.sleep(0.05)
        with lock:
            used.append(thing)

    wall = run_clients(client, 4, prepare=prepare)
    assert wall < 0.25 and sorted(map(id, made)) == sorted(map(id, used)) and len(set(map(id, used))) == 4


def test_without_prepare_clients_take_no_argument():
    calls = []
    wall = run_clients(lambda: calls.append(1), 3)
    assert calls == [1, 1, 1] and wall < 1


def test_read_bandwidth_is_a_plausible_rate():
    from tools.measure import read_bandwidth

    bw = read_bandwidth(nbytes=16 * 2**20, repeats=2)
    assert 1e8 < bw < 1e13  # bytes per second: between 0.1 GB/s and 10 TB/s


def test_bytes_per_token_reads_the_safetensors_header_and_config(tmp_path):
    import json

    import torch
    from safetensors.torch import save_file

    from tools.measure import bytes_per_token

    save_file({"embed": torch.zeros(10, 8), "w": torch.zeros(8, 4, dtype=torch.bfloat16)}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 4, "hidden_size": 32,
                                                      "num_hidden_layers": 3, "num_key_value_heads": 2}))
    # 112 parameters, whatever their stored dtype; KV: 2 (K and V) x 3 layers x 2 heads x 8 dims per token
    assert bytes_per_token(tmp_path, "float32", 100) == (112 * 4, 2 * 3 * 2 * 8 * 4 * 100)
    assert bytes_per_token(tmp_path, "bfloat16", 1) == (112 * 2, 2 * 3 * 2 * 8 * 2)
