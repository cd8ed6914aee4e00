PY ?= python3
STAMP := .setup-done

.PHONY: setup test serve clean image image-smoke image-rebuild-check compose-smoke

# `make test` does all set-up on a fresh machine, then runs every test (GPU tests skip without a GPU),
# in TEST_WORKERS pytest-xdist processes (CI's 2 cores), a test file each at a time (its module
# fixtures built once). TEST_WORKERS=0 runs them in this process.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# `make serve` starts the HTTP server; an empty store (./models) gets the demo model first.
serve: $(STAMP)
	$(PY) -m wcodec serve $(SERVE_ARGS)

setup: $(STAMP)

# The container image (README, "Deploy"): VARIANT=cpu (default) or cuda. Not part of `make test`.
# `image` builds wcodec:<version>-<variant>; `image-smoke` builds it, runs it and checks it (health,
# a chat answer, /metrics, non-root, read-only root, SASS of every architecture for cuda, no secret
# in a layer); `image-rebuild-check` shows a change to service/ reusing the dependency layers;
# `compose-smoke` runs it beside Prometheus and checks the scrape through Prometheus' API.
VARIANT ?= cpu
image:
	VARIANT=$(VARIANT) deploy/image.sh build

image-smoke:
	VARIANT=$(VARIANT) deploy/image.sh smoke

image-rebuild-check:
	VARIANT=$(VARIANT) deploy/image.sh rebuild-check

compose-smoke:
	VARIANT=$(VARIANT) deploy/compose-smoke.sh

$(STAMP): pyproject.toml setup.py scripts/setup.sh $(wildcard cuda_ext/csrc/*)
	PY=$(PY) bash scripts/setup.sh
	touch $@

clean:
	rm -rf $(STAMP) build *.egg-info .pytest_cache
