#!/usr/bin/env bash
# The layer check: import-linter's contracts (.importlinter) over the package as it is installed.
# The repository keeps attnbench.backends in backends/ and attnbench.tuning in tuning/ (pyproject's
# package-dir), which import-linter cannot follow, so the check runs over a copy laid out as an
# installed wheel lays it out: attnbench/ with backends/ and tuning/ inside it.
set -euo pipefail
cd "$(dirname "$0")/.."
tree="$(mktemp -d)"
trap 'rm -rf "$tree"' EXIT
cp -r attnbench "$tree/attnbench"
cp -r backends "$tree/attnbench/backends"
cp -r tuning "$tree/attnbench/tuning"
config="$PWD/.importlinter"
cd "$tree"  # import-linter puts the working directory first on the path
PYTHONPATH="$tree" lint-imports --no-cache --config "$config" "$@"
