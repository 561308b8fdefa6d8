# The two commands of the README. Both install what they need first (scripts/setup.sh).
# The suite runs on one pytest-xdist worker per core (-n auto), a test file per worker at a time
# (--dist loadfile: module fixtures built once, and files whose tests share state stay together);
# most tests compute on one thread, so on 2 cores this nearly halves the suite's time.
# PYTEST_ARGS adds pytest options, e.g. PYTEST_ARGS="-n 0" for one process.
.PHONY: setup demo test test-all protos gpu-bundle gpu-check

PYTEST_ARGS ?=

setup:
	bash scripts/setup.sh

demo: setup
	bash scripts/demo.sh

test: setup
	bash scripts/setup_clients.sh
	.venv/bin/python -m pytest -q -n auto --dist loadfile -m "not slow or ci" --durations=20 $(PYTEST_ARGS)

test-all: setup
	bash scripts/setup_clients.sh
	.venv/bin/python -m pytest -q -n auto --dist loadfile $(PYTEST_ARGS)

protos: setup
	.venv/bin/python -m specdec_tools.protogen

# The GPU evidence (benchmarks/cuda_check.sh): gpu-bundle here (needs the package index and the demo's
# converted SmolLM2), then gpu-check on the CUDA host from the working tree with .gpu/ carried.
gpu-bundle: setup
	bash benchmarks/cuda_bundle.sh

gpu-check:
	bash benchmarks/cuda_check.sh
