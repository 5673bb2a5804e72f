# Two commands do all set-up on a fresh machine:  `make demo`  and  `make test`.
SHELL := /bin/bash
VENV  := .venv
PY    := $(VENV)/bin/python
APT_PKGS := erofs-utils busybox-static gcc libc6-dev debootstrap nftables iproute2 openssl runsc docker-registry postgresql
STAMP := $(VENV)/.installed

.PHONY: setup system-deps daemon demo demo-platform test test-vm bench repro clean docker-engine

# Debian packages first (gcc builds the C helper), then the venv, then the helper itself: the
# editable install builds it only if a compiler was already there, so it is built here, explicitly.
setup: $(STAMP)
	$(PY) -m shoal.backends.container.native build
	$(PY) -m shoal.lazy.fastread build

system-deps:
	@missing=""; \
	command -v mkfs.erofs >/dev/null || missing="$$missing erofs-utils"; \
	{ [ -x /bin/busybox ] && /bin/busybox --list | grep -qx sh; } || missing="$$missing busybox-static"; \
	command -v gcc >/dev/null || missing="$$missing gcc"; \
	[ -e /usr/lib/x86_64-linux-gnu/libc.a ] || [ -e /usr/lib/aarch64-linux-gnu/libc.a ] || missing="$$missing libc6-dev"; \
	command -v debootstrap >/dev/null || missing="$$missing debootstrap"; \
	command -v nft >/dev/null || missing="$$missing nftables"; \
	command -v ip >/dev/null || missing="$$missing iproute2"; \
	command -v openssl >/dev/null || missing="$$missing openssl"; \
	command -v runsc >/dev/null || missing="$$missing runsc"; \
	[ -x /usr/bin/docker-registry ] || missing="$$missing docker-registry"; \
	ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1 || missing="$$missing postgresql"; \
	[ -x /usr/bin/chromium ] || missing="$$missing chromium"; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	fi

# order-only: the system packages are checked on every `make setup`, but do not make the venv stale
$(STAMP): pyproject.toml setup.py | system-deps
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[test]'
	touch $(STAMP)

# shoald, the only root process: started (detached, log in <root>/shoald.log) unless one already answers
# on /run/shoal/shoald.sock; members of the `shoal` group then use Shoal without root
daemon: setup
	$(PY) -m shoal.server.ensure

# the bundled SWE suite through the agent loop (oracle + null; a real model if SHOAL_LLM_URL is set)
demo: daemon
	$(PY) -m shoal.demo

# the platform tour: layers, sandboxes, isolation, shoald, benchmarks against Docker
demo-platform: setup docker-engine
	$(PY) -m shoal.demo --platform

# the benchmark compares against a real Docker engine (Debian docker.io; the script starts dockerd)
docker-engine:
	@command -v dockerd >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io >/dev/null; }

test: setup
	$(PY) -m pytest -q -p no:cacheprovider tests

# the core functional + security subset inside a Debian 12 VM (stock 6.1 kernel, cgroup v2 only, loop-
# mounted EROFS) under QEMU; the image is cached in /var/cache/shoal-vm. See docs/platforms.md.
test-vm: setup
	@command -v qemu-system-x86_64 >/dev/null && command -v debootstrap >/dev/null && \
	  command -v debugfs >/dev/null && command -v git >/dev/null || { \
	  echo "installing Debian packages: qemu-system-x86 debootstrap e2fsprogs git"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq \
	    --no-install-recommends qemu-system-x86 debootstrap e2fsprogs git >/dev/null; }
	$(PY) vm/run.py

bench: setup docker-engine
	$(PY) bench/startup.py
	$(PY) bench/burst.py
	$(PY) bench/rollout.py

# the OPD token-selection reproduction (CPU, ~40 min): docs/results/opd_repro.{json,md,png}
repro: setup
	$(PY) -m shoal.train.repro --config full --out docs/results

clean:
	rm -rf $(VENV) src/shoal/backends/container/native/build
