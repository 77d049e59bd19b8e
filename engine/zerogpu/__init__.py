"""ZeroGPU mode: a Hugging Face Space whose GPU exists only inside each ``@spaces.GPU`` call.

On ZeroGPU every decorated call runs in a worker forked from the main process; its arguments
and result are pickled, and nothing it writes reaches the main process except what it returns
(``/work/shared/field-notes.md``, "ZeroGPU"). So the engine keeps everything of record where it
outlives a call, in the main process's host memory: the radix tree, the pool of KV bytes, the
requests, the scheduler. Only the model's arithmetic crosses over, one forward per call:

    main process (tree, pool, scheduler)             the call's worker (the device)
    step_call.pack: the forward's rows, the KV  ---> step_call.run: a pool of just those slots,
      of every slot they read, as CPU tensors          the same forward_paged, the new KV read back
    step_call.apply: the new KV into the pool   <--- logits and the new KV, as CPU tensors

Modules: ``detect.py`` (is this a ZeroGPU Space, or the emulation), ``emulation.py`` (ZeroGPU's
process model on any machine: a forked worker per call, pickled in and out; what CI tests run
on), ``step_call.py`` (one forward as plain data, both sides), ``runner.py`` (``ZeroGPURunner``:
a ``ModelRunner`` whose forwards run through the call). The engine, the scheduler and the page
do not know the difference: the answer is the same computation on the same KV.
"""
