# The two commands of the README. Both install what they need first (scripts/setup.sh).
# PYTEST_ARGS adds pytest options to the test targets, e.g. PYTEST_ARGS="-n 4 --dist loadfile"
# (pytest-xdist) on a machine with cores to spare; on 2 cores it saved ~15% and is not the default.
.PHONY: setup demo test test-all protos

PYTEST_ARGS ?=

setup:
	bash scripts/setup.sh

demo: setup
	bash scripts/demo.sh

test: setup
	bash scripts/setup_clients.sh
	.venv/bin/python -m pytest -q -m "not slow or ci" --durations=20 $(PYTEST_ARGS)

test-all: setup
	bash scripts/setup_clients.sh
	.venv/bin/python -m pytest -q $(PYTEST_ARGS)

protos: setup
	.venv/bin/python -m specdec_tools.protogen
