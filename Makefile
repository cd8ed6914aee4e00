PY ?= python3
STAMP := .setup-done

.PHONY: setup test serve clean

# `make test` does all set-up on a fresh machine, then runs every test (GPU tests skip without a GPU).
test: $(STAMP)
	$(PY) -m pytest -q

# `make serve` starts the HTTP server; an empty store (./models) gets the demo model first.
serve: $(STAMP)
	$(PY) -m wcodec serve $(SERVE_ARGS)

setup: $(STAMP)

$(STAMP): pyproject.toml setup.py scripts/setup.sh $(wildcard cuda_ext/csrc/*)
	PY=$(PY) bash scripts/setup.sh
	touch $@

clean:
	rm -rf $(STAMP) build *.egg-info .pytest_cache
