#!/usr/bin/env bash
# The type check: mypy (pyproject's [tool.mypy]) over attnbench with its backends and tuning, and the
# plugins' sources; any error fails it. Like the layer check (scripts/lint-imports.sh), mypy cannot
# follow pyproject's package-dir (attnbench.backends lives in backends/, attnbench.tuning in tuning/),
# so it checks a tree laid out as an installed wheel lays it out: attnbench/ with backends/ and
# tuning/ inside it, made of links to the repository's files. The tree is build/typecheck/, kept
# between runs for mypy's cache; the messages name the files by their paths in the repository.
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$PWD"
tree=build/typecheck
rm -rf "$tree/attnbench" "$tree/plugins"
mkdir -p "$tree/attnbench"
for entry in attnbench/*; do
    ln -s "$repo/$entry" "$tree/$entry"
done
ln -s "$repo/backends" "$tree/attnbench/backends"
ln -s "$repo/tuning" "$tree/attnbench/tuning"
ln -s "$repo/plugins" "$tree/plugins"
cd "$tree"
mypy --config-file "$repo/pyproject.toml" "$@" | sed -e 's#^attnbench/backends/#backends/#' -e 's#^attnbench/tuning/#tuning/#'
