# The docker-compose stack in a real container engine. Included by the top-level Makefile.
# Targets: test-compose, compose-images, compose-plugins, compose-base, compose-standins,
# compose-gpu-image (Dockerfile.gpu on the local base; large, so not in CI).
#
#   test-compose     starts dockerd if none runs (and stops it after), builds the images, then
#                    runs tests/compose/ (pytest -m compose): `docker compose --profile scale
#                    up --wait`, checks through nginx from outside, `down -v` (docs/operations.md)
#   compose-images   the gateway image prismgate:cpu, built from COMPOSE_PYTHON_IMAGE
#   compose-plugins  pinned Compose v2 and buildx from Debian's archive, where docker has none
#   compose-base     a Python 3.11 base image made from Debian packages with mmdebstrap (for
#                    machines that reach no container registry), cached: skipped when it exists
#   compose-standins local stand-ins for redis, nginx and prometheus, from Debian packages
#
# Set COMPOSE_PUBLIC_IMAGES=1 to use the public images (python, redis, nginx, prom/prometheus)
# instead of the local ones. The CPU torch comes from TORCH_INDEX_URL (PyTorch's CPU index) or,
# when TORCH_FIND_LINKS is set, from a folder of wheels: here the local wheel that pip's
# find-links names is copied into wheels/ and used (the build context's wheels/ is mounted).

DOCKER ?= docker
COMPOSE_PROJECT ?= prismgate
COMPOSE_DEBIAN_MIRROR ?= http://deb.debian.org/debian
COMPOSE_PUBLIC_IMAGES ?=
# Compose v2 and buildx from Debian 13's archive, pinned by version and checksum.
COMPOSE_PLUGIN_DEB ?= pool/main/d/docker-compose/docker-compose_2.26.1-4_amd64.deb
COMPOSE_PLUGIN_SHA256 ?= 47681197cb2b1ab88206b42a1a92fc75f50d9530a6322d03494a473eed0408ea
BUILDX_PLUGIN_DEB ?= pool/main/d/docker-buildx/docker-buildx_0.13.1+ds1-3_amd64.deb
BUILDX_PLUGIN_SHA256 ?= fcf8c48204d1603c8f209451d7827eb91bf30759578baf7704e9e1a87e5f1d7f
DOCKER_PLUGIN_DIR ?= $(or $(DOCKER_CONFIG),$(HOME)/.docker)/cli-plugins
# The local base: Debian 12's Python 3.11 (the version the image's torch wheel is built for);
# the stand-ins: Debian 13, whose nginx (1.26) knows `http2 on;`.
LOCAL_PYTHON_IMAGE ?= prismgate-local/python:3.11-bookworm
LOCAL_DEBIAN_IMAGE ?= prismgate-local/debian:trixie
LOCAL_STANDIN_TAG ?= prismgate-local
ifeq ($(COMPOSE_PUBLIC_IMAGES),)
COMPOSE_PYTHON_IMAGE ?= $(LOCAL_PYTHON_IMAGE)
COMPOSE_IMAGE_ENV ?= REDIS_IMAGE=$(LOCAL_STANDIN_TAG)/redis:trixie NGINX_IMAGE=$(LOCAL_STANDIN_TAG)/nginx:trixie \
	PROMETHEUS_IMAGE=$(LOCAL_STANDIN_TAG)/prometheus:trixie
COMPOSE_LOCAL_IMAGES := compose-base compose-standins
else
COMPOSE_PYTHON_IMAGE ?= python:3.11.13-slim-bookworm
COMPOSE_IMAGE_ENV ?=
COMPOSE_LOCAL_IMAGES :=
endif
# Where the CPU torch comes from: PyTorch's CPU index unless a find-links folder is named.
# On a machine whose pip finds a local CPU wheel (pip config: global.find-links), that wheel.
PIP_FIND_LINKS_DIR ?= $(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null)
TORCH_WHEEL ?= $(firstword $(wildcard $(addsuffix /torch-2.13.0+cpu-cp311-*.whl,$(PIP_FIND_LINKS_DIR))))
TORCH_INDEX_URL ?= https://download.pytorch.org/whl/cpu
TORCH_FIND_LINKS ?= $(if $(TORCH_WHEEL),/wheels)
# The host's CA bundle reaches pip through a build secret (never a layer): for a package index
# behind a TLS-intercepting proxy.
, := ,
CA_BUNDLE ?= $(wildcard /etc/ssl/certs/ca-certificates.crt)
BUILD_SECRET := $(if $(CA_BUNDLE),--secret id=ca_bundle$(,)src=$(CA_BUNDLE))
COMPOSE_PYTEST_ARGS ?=

.PHONY: test-compose compose-images compose-plugins compose-base compose-standins compose-gpu-image _compose-plugin _debian-image

compose-plugins:
	@$(DOCKER) compose version >/dev/null 2>&1 || $(MAKE) --no-print-directory _compose-plugin \
		NAME=docker-compose DEB=$(COMPOSE_PLUGIN_DEB) SHA256=$(COMPOSE_PLUGIN_SHA256)
	@$(DOCKER) buildx version >/dev/null 2>&1 || $(MAKE) --no-print-directory _compose-plugin \
		NAME=docker-buildx DEB=$(BUILDX_PLUGIN_DEB) SHA256=$(BUILDX_PLUGIN_SHA256)
	@$(DOCKER) compose version && $(DOCKER) buildx version

# One plugin binary out of its Debian package, checked against the pinned checksum.
_compose-plugin:
	@echo "installing $(NAME) from Debian's archive ($(notdir $(DEB))) into $(DOCKER_PLUGIN_DIR)"
	rm -rf build/compose/$(NAME) && mkdir -p build/compose/$(NAME) $(DOCKER_PLUGIN_DIR)
	curl -fsSL --retry 3 -o build/compose/$(NAME)/package.deb $(COMPOSE_DEBIAN_MIRROR)/$(DEB)
	echo "$(SHA256)  build/compose/$(NAME)/package.deb" | sha256sum -c --quiet
	dpkg-deb -x build/compose/$(NAME)/package.deb build/compose/$(NAME)/root
	install -m 0755 build/compose/$(NAME)/root/usr/libexec/docker/cli-plugins/$(NAME) $(DOCKER_PLUGIN_DIR)/$(NAME)

# A base image from Debian packages: nothing from a container registry. mmdebstrap comes
# from Debian too (apt-get install mmdebstrap).
compose-base:
	@$(MAKE) --no-print-directory _debian-image IMAGE=$(LOCAL_PYTHON_IMAGE) SUITE=bookworm \
		INCLUDE=python3,python3-venv,python-is-python3,passwd,ca-certificates CMD='["python3"]'
	@$(MAKE) --no-print-directory _debian-image IMAGE=$(LOCAL_DEBIAN_IMAGE) SUITE=trixie \
		INCLUDE=passwd,ca-certificates CMD='["bash"]'

_debian-image:
	@if $(DOCKER) image inspect $(IMAGE) >/dev/null 2>&1; then echo "$(IMAGE): cached"; else \
		command -v mmdebstrap >/dev/null || { echo "mmdebstrap is needed: apt-get install mmdebstrap" >&2; exit 1; }; \
		echo "$(IMAGE): mmdebstrap $(SUITE) ($(INCLUDE))"; \
		mkdir -p build/compose && rm -f build/compose/$(SUITE).tar; \
		mmdebstrap --quiet --variant=minbase --include=$(INCLUDE) $(SUITE) build/compose/$(SUITE).tar $(COMPOSE_DEBIAN_MIRROR) \
		&& $(DOCKER) import --change 'ENV LANG=C.UTF-8' --change 'CMD $(CMD)' build/compose/$(SUITE).tar $(IMAGE) \
		&& rm -f build/compose/$(SUITE).tar; fi

compose-standins: compose-base compose-plugins
	for name in redis nginx prometheus; do \
		$(DOCKER) build -q --build-arg BASE_IMAGE=$(LOCAL_DEBIAN_IMAGE) -t $(LOCAL_STANDIN_TAG)/$$name:trixie deploy/local/$$name || exit 1; \
	done

compose-images: $(COMPOSE_LOCAL_IMAGES) compose-plugins
	@mkdir -p build/compose
	@if [ -n "$(TORCH_WHEEL)" ]; then echo "torch: $(TORCH_WHEEL) (copied into wheels/)"; cp -u $(TORCH_WHEEL) wheels/; \
	else echo "torch: $(if $(TORCH_FIND_LINKS),$(TORCH_FIND_LINKS),$(TORCH_INDEX_URL))"; fi
	$(DOCKER) build --progress=plain -t prismgate:cpu --build-arg PYTHON_IMAGE=$(COMPOSE_PYTHON_IMAGE) \
		--build-arg TORCH_INDEX_URL=$(TORCH_INDEX_URL) --build-arg TORCH_FIND_LINKS=$(TORCH_FIND_LINKS) \
		$(BUILD_SECRET) . > build/compose/build.log 2>&1 || { tail -40 build/compose/build.log; exit 1; }
	@grep -E '^#[0-9]+ (DONE|CACHED)' build/compose/build.log | tail -3 || true

# dockerd is started only when none answers, and stopped after only when this target started it.
# Where no engine can run, the target says so and skips (exit 0); pytest skips the same way.
test-compose: setup
	@if ! command -v $(DOCKER) >/dev/null; then \
		echo "SKIP test-compose: no docker command here (apt-get install docker.io)"; exit 0; fi; \
	started=""; \
	if ! $(DOCKER) info >/dev/null 2>&1; then \
		if ! command -v dockerd >/dev/null; then \
			echo "SKIP test-compose: no container engine answers and there is no dockerd to start (apt-get install docker.io)"; exit 0; fi; \
		echo "starting dockerd (log: build/compose/dockerd.log)"; mkdir -p build/compose; \
		dockerd >build/compose/dockerd.log 2>&1 & started=$$!; \
		for i in $$(seq 60); do $(DOCKER) info >/dev/null 2>&1 && break; sleep 1; done; \
		if ! $(DOCKER) info >/dev/null 2>&1; then \
			echo "SKIP test-compose: dockerd cannot run here; its log ends:"; tail -5 build/compose/dockerd.log; \
			kill $$started 2>/dev/null; exit 0; fi; \
	fi; \
	trap 'if [ -n "$$started" ]; then echo "stopping the dockerd this target started"; kill $$started; wait $$started; fi' EXIT; \
	t0=$$(date +%s); \
	$(MAKE) --no-print-directory compose-images || exit 1; \
	echo "images built in $$(( $$(date +%s) - t0 )) s; prismgate:cpu is $$($(DOCKER) image inspect --format '{{.Size}}' prismgate:cpu | awk '{printf "%.2f GB", $$1/1e9}')"; \
	$(COMPOSE_IMAGE_ENV) COMPOSE_PROJECT_NAME=$(COMPOSE_PROJECT) OMP_NUM_THREADS=1 \
		$(BIN)/pytest -m compose -rs -p no:cacheprovider tests/compose $(COMPOSE_PYTEST_ARGS); rc=$$?; \
	cat build/compose/measurements.json 2>/dev/null; exit $$rc

# The GPU image from the local base instead of NVIDIA's CUDA image (the CUDA libraries come
# with the torch and vLLM wheels; building needs no GPU). Large (vLLM and CUDA torch): not in CI.
compose-gpu-image: compose-base compose-plugins
	$(DOCKER) build -f Dockerfile.gpu -t prismgate:gpu --build-arg CUDA_IMAGE=$(LOCAL_PYTHON_IMAGE) $(BUILD_SECRET) .
