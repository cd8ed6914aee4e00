"""wcodec's HTTP server: `.wcodec` models decoded onto the device at load time, generation in
TGI's API, model control, Prometheus metrics. `create_app(Settings())` builds the app;
`wcodec serve` runs it under uvicorn. Imports go service -> cuda_ext -> codec."""
