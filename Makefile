# xlakit: every target calls a script; the variables it reads are listed here.
#
#   PYTHON         interpreter that creates the venv (3.11 or newer)   [python3]
#   VENV           the development virtual environment                [.venv]
#   PROFILE        VERSIONS.toml profile installed by `setup`; a torchtpu*
#                  profile gets no PJRT test tools (torch_xla, jax) [cpu-dev]
#   PYTEST_ARGS    extra arguments for `make test`                     []
#   TEST_WORKERS   pytest-xdist options of `make test`: test files spread over
#                  up to 4 processes (most tests wait on processes they start);
#                  `TEST_WORKERS=` runs all in one  [-n auto --maxprocesses 4 --dist loadfile;
#                  none for a torchtpu* profile: each process would start TorchTPU]
#                  (a torchtpu* PROFILE: `test` runs tests/torchtpu, `bench` bench_torchtpu.py)
#   BENCH_ARGS     extra arguments for `make bench`                    []
#   FAULT_ARGS     extra arguments for `make faults` (--rounds, --seed) []
#   TORCH_XLA_GIT  torch_xla git URL or local mirror (build, patches-check,
#                  preflight: [VERSIONS.toml URL]; cxx-check: the upstream
#                  files are checked only when it is given)          []
#   PYTORCH_GIT    pytorch git URL or local mirror (build, preflight)
#                                                         [VERSIONS.toml URL]
#   BUILD_ARGS     extra arguments for build/xlakit_build.py, e.g. --dry-run []
#   INSTALL_PYTHON interpreter whose environment `make install` fills [python3]
#   WHEELHOUSE     folder of the wheels `make test-installed` installs with
#                  --no-index (`make wheelhouse` downloads them)  [build/_out/wheelhouse]

PYTHON ?= python3
VENV ?= .venv
PROFILE ?= cpu-dev
PYTEST_ARGS ?=
BENCH_ARGS ?=
FAULT_ARGS ?=
TORCH_XLA_GIT ?=
PYTORCH_GIT ?=
BUILD_ARGS ?=
INSTALL_PYTHON ?= python3
WHEELHOUSE ?= build/_out/wheelhouse

VPY := $(VENV)/bin/python
SETUP_STAMP := $(VENV)/.xlakit-setup
XBR := $(PYTHON) build/xlakit_build.py requirements --profile $(PROFILE)
TORCHTPU := $(filter torchtpu%,$(PROFILE))
TEST_TOOLS := $(if $(TORCHTPU),,--test-tools)

.PHONY: setup test faults demo bench clean build patches-check cxx-check wheel wheel-check wheelhouse \
	test-installed install preflight

setup: $(SETUP_STAMP)

# Re-run when the pins or the package definition change.
$(SETUP_STAMP): VERSIONS.toml pyproject.toml setup.py
	$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11) and "xlakit needs Python 3.11+, found " + sys.version.split()[0])'
	test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install --upgrade pip setuptools wheel
	$(VPY) -m pip install $$($(XBR) $(TEST_TOOLS))
	nodeps="$$($(XBR) --no-deps)"; test -z "$$nodeps" || $(VPY) -m pip install --no-deps $$nodeps
	$(VPY) -m pip install -e '.[test]'
	touch $@
	$(if $(TORCHTPU),@$(VPY) -c 'from xlakit.runtime.torchtpu import setup_hint; print(setup_hint("$(VENV)"))')

TEST_WORKERS ?= $(if $(TORCHTPU),,-n auto --maxprocesses 4 --dist loadfile)

test: setup
	$(VPY) -m pytest $(TEST_WORKERS) $(PYTEST_ARGS) $(if $(TORCHTPU),tests/torchtpu)

# Saves under random faults by PID (kill, Ctrl-C, stop/continue, a mutating
# thread), every checkpoint read back; one line, exit 1 unless all hold.
faults: setup
	PJRT_DEVICE=$${PJRT_DEVICE:-CPU} $(VPY) tests/support/fault_injection.py $(FAULT_ARGS)

demo: setup
	PJRT_DEVICE=$${PJRT_DEVICE:-CPU} $(VPY) examples/demo.py

bench: setup
ifneq ($(TORCHTPU),)
	$(VPY) bench/bench_torchtpu.py $(BENCH_ARGS)
else
	PJRT_DEVICE=$${PJRT_DEVICE:-CPU} $(VPY) bench/bench_save.py $(BENCH_ARGS)
	PJRT_DEVICE=$${PJRT_DEVICE:-CPU} $(VPY) bench/bench_async.py
	PJRT_DEVICE=$${PJRT_DEVICE:-CPU} $(VPY) bench/bench_load.py
	PJRT_DEVICE=$${PJRT_DEVICE:-CPU} $(VPY) bench/bench_compile.py
	PJRT_DEVICE=$${PJRT_DEVICE:-CPU} $(VPY) bench/bench_cache_tier.py
	PJRT_DEVICE=$${PJRT_DEVICE:-CPU} $(VPY) bench/bench_objstore.py
	$(VPY) bench/bench_replicated.py
	$(VPY) bench/bench_memory.py
	$(VPY) bench/bench_local_tier.py --gcs
endif

# Source build (build/xlakit_build.py; `BUILD_ARGS=--dry-run` prints the plan).
XB := $(PYTHON) build/xlakit_build.py
GIT_ARGS := --torch-xla-git="$(TORCH_XLA_GIT)" --pytorch-git="$(PYTORCH_GIT)"

build:
	$(XB) build $(GIT_ARGS) $(BUILD_ARGS)

preflight:
	$(XB) preflight $(GIT_ARGS) $(BUILD_ARGS)

patches-check:
	$(XB) patches-check --torch-xla-git="$(TORCH_XLA_GIT)" $(BUILD_ARGS)

# Compile checks against real XLA headers + the real-PJRT cache test; the
# venv provides the cpu-dev torch headers.
cxx-check: setup
	$(XB) cxx-check --torch-xla-git="$(TORCH_XLA_GIT)" --python "$(abspath $(VPY))" $(BUILD_ARGS)

# The release: sdist + one manylinux wheel into wheels/, built by the pinned zig
# (VERSIONS.toml [wheel]), which `setup` installs; `wheel-check`: auditwheel on
# every wheel in wheels/, failing on a tag newer than the floor.
wheel: setup
	$(VPY) build/xlakit_build.py wheel $(BUILD_ARGS)

wheel-check: setup
	$(VPY) build/xlakit_build.py wheel-check $(BUILD_ARGS)

wheelhouse: setup
	$(VPY) build/xlakit_build.py wheelhouse --dest "$(WHEELHOUSE)" $(BUILD_ARGS)

# The wheel installed as a user installs it, offline, outside the checkout
# (tests/build/test_installed_wheel.py).
test-installed: wheel wheelhouse
	XLAKIT_WHEELHOUSE="$(abspath $(WHEELHOUSE))" $(VPY) -m pytest -p no:cacheprovider -s \
		tests/build/test_installed_wheel.py

install:
	$(XB) install --python $(INSTALL_PYTHON) $(BUILD_ARGS)

clean:
	rm -rf $(VENV) wheels build/_out python/*.egg-info
