PY ?= python3
STAMP := .setup-done

.PHONY: setup test clean

# `make test` does all set-up on a fresh machine, then runs every test (GPU tests skip without a GPU).
test: $(STAMP)
	$(PY) -m pytest -q

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/setup.sh
	PY=$(PY) bash scripts/setup.sh
	touch $@

clean:
	rm -rf $(STAMP) build *.egg-info .pytest_cache
