# The two commands of the README's quick start. Both set up .venv first (idempotent).
.PHONY: serve test setup bench

setup:
	@bash scripts/setup.sh

serve: setup
	.venv/bin/mlxcel serve $(ARGS)

test: setup
	.venv/bin/python -m pytest $(ARGS)

bench: setup
	.venv/bin/python bench/run.py $(ARGS)
