# The two commands of the README. Both install what they need first (scripts/setup.sh).
.PHONY: setup demo test test-all protos

setup:
	bash scripts/setup.sh

demo: setup
	bash scripts/demo.sh

test: setup
	bash scripts/setup_clients.sh
	.venv/bin/python -m pytest -q -m "not slow or ci"

test-all: setup
	bash scripts/setup_clients.sh
	.venv/bin/python -m pytest -q

protos: setup
	.venv/bin/python -m specdec_tools.protogen
