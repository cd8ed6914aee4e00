"""wcodec's HTTP server: `.wcodec` models decoded onto the device at load time (or kept compressed
there), TGI- and OpenAI-style generation with continuous batching, model control (and Triton's repository API),
Prometheus metrics. `create_app(Settings())` builds the app; `wcodec serve` runs it under uvicorn.

    app.py, settings.py, deps.py, routes/, schemas/, errors.py, metrics.py, timeline.py   the app
    refusals.py        a generation refused as invalid, in the metrics (status="validation")
    registry.py        the models' states, leases and memory budget
    inference.py, chat.py  TGI and OpenAI requests <-> engine requests and token events
    load/              archive -> device (the store, reads, host cache, pipeline; job.Loader)
    model/             the served model (build on meta, Llama in plain PyTorch, compressed weights)
    engine/            requests in, token events out (worker, continuous batching, KV cache, sampling)

docs/ARCHITECTURE.md draws the path of a load and of a request. Imports go service -> cuda_ext ->
codec; nothing heavy is imported at package import."""
