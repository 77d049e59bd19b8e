"""ZeroGPU mode: a Hugging Face Space whose GPU exists only inside each ``@spaces.GPU`` call.

On ZeroGPU every decorated call runs in a worker forked from the main process; its arguments and
results are pickled, and nothing it writes reaches the main process except what it returns
(``docs/GPU.md``, "ZeroGPU mode"). ZeroGPU charges each call to the visitor whose Gradio request
it was made in (the ``X-IP-Token`` header ``spaces`` sends with the schedule). So the engine keeps
everything of record in the main process's host memory (the radix tree, the KV pool, the
requests, the scheduler) and makes one call per visitor turn, in that visitor's context::

    main process (tree, pool, scheduler)              the turn's worker (the device)
    turns: the request's first forward starts   --->  turn_call.run: the cached prefix's KV in,
      its call, in the visitor's context               the prompt's chunks, then decode, each
    turns: each forward's rows from their       <---   forward streamed out as it is done
      calls' streams, KV into the pool of record       (logits and new KV, CPU tensors)

Modules: ``detect.py`` (is this a ZeroGPU Space), ``runner.py`` (``ZeroGPURunner``: the model
placed on ``cuda`` at start, the decorated GPU functions and what each asks for, the worker's
runner), ``turns.py`` (``TurnScheduler``: one call per turn, in the visitor's context),
``turn_call.py`` (a turn as plain data, both sides), ``step_call.py`` (one forward outside any
turn, both sides). The tree, the page and the API do not know the difference: the answer is the
same computation on the same KV.
"""
