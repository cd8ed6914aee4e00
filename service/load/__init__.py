"""Archive -> device: the store and its names, reads, early reads, the host cache, device checks and
the pipeline. The registry's one entry point is `job.Loader`; `pipeline.load_archive` is the
whole-archive load of the CLI and the Python API. Nothing here is imported at package import:
`early_read` must stay importable before torch (wcodec serve's first instant).

    names.py        model names and the store's file suffix (no imports)
    store.py        ModelStore: the `<name>.wcodec` files of a folder, their sizes
    demo.py         the demo model, compressed into an empty store
    reading.py      ArchiveFile (pread / O_DIRECT), Blobs (checksums as pieces land), read_range
    early_read.py   EarlyRead: an archive read into memory from process start (no torch); ImportGate
    early_load.py   EarlyLoad: a preloaded model decoded right after torch's import
    hostcache.py    HostCache: compressed archives kept in host memory between loads
    memory.py       host memory: available bytes, unmapping, malloc_trim after an unload
    devicecheck.py  stream checksums on the GPU, beside the decode
    ring.py         layer batches and the ring of (pinned) host buffers they are read into
    pipeline.py     decode_archive: read -> H2D -> decode, overlapped; load_archive
    job.py          Loader: one model's load (early load, host cache, decode, build), its metrics
    failure.py      a failed load: its typed error, the frames it must not keep alive
"""
