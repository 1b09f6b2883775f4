#!/bin/sh
# A stand-in for `python -m kvdump.backends torch` that answers --help only, for the tests of
# tests/python/test_exec_adapters.cpp (tests/runner/test_runner_skips.cpp runs them with
# KVAUDIT_TORCH_ADAPTER="sh THIS VARIANT"):
#   current        the options the real adapter has (python/kvdump/backends/__main__.py)
#   without-fault  an adapter from before --fault: the help text lacks it
variant=$1
shift
[ "$1" = "--help" ] || { echo "torch_adapter_help.sh: only --help is answered" >&2; exit 2; }
echo "usage: python -m kvdump.backends torch [-h] [--device DEVICE]"
echo "                                       [--write {server,saturate,kvdump}]"
[ "$variant" = current ] && echo "                                       [--fault FAULT]"
echo
echo "options:"
echo "  --device DEVICE       cpu or cuda[:N]"
echo "  --write {server,saturate,kvdump}"
if [ "$variant" = current ]; then
  echo "  --fault FAULT         plant a wrong convention (list below)"
  echo
  echo "planted faults (--fault, repeatable; for tests):"
  echo "  round-toward-zero   write    codes rounded toward zero"
  echo "  lse-base2           output   lse as log2 of the softmax sum"
fi
