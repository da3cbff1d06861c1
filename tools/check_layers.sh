#!/usr/bin/env bash
# The one-way layers (CMakeLists.txt), checked on the sources. The object libraries' include roots
# already make a forbidden include a compile error; this adds what roots cannot see, and says which
# rule a line breaks:
#   src/        includes src/, common/ ("hl/..."), include/ ("headloss.h") and, of kernels/, the
#               launch contracts alone ("kernels/<op>/launch.h"); no CUDA header
#   kernels/    includes kernels/, common/ and include/: nothing of src/
#   common/     includes common/ and include/ only (both sides compile it); no CUDA header
#   contracts   kernels/<op>/launch.h: standard headers, "headloss.h" and "hl/..." only
#   everywhere  no include climbs out of its root ("../"), which would get round the roots
# (src/jax/ is the JAX adapter, a target of its own against the public header and XLA's.)
# Run by CTest as the test `layers`; prints each violation and exits 1 when there is one.
set -uo pipefail
cd "$(dirname "$0")/.."

bad=0
violation() {
  echo "$1: $2"
  bad=1
}
# Whether include $2 of file $1 names a file in the file's folder or under one of the roots $3...
found() {
  local file=$1 inc=$2
  shift 2
  [ -e "$(dirname "$file")/$inc" ] && return 0
  for r in "$@"; do
    [ -e "$r/$inc" ] && return 0
  done
  return 1
}

cuda_header='^\s*#\s*include\s*<(cuda|cublas|nccl|cub/|cooperative_groups|mma\.h|crt/|nv)'
while IFS= read -r hit; do
  violation "${hit%%:*}:$(cut -d: -f2 <<<"$hit")" "a CUDA header on the host side"
done < <(grep -rnE "$cuda_header" src common --exclude-dir=jax; grep -nE "$cuda_header" kernels/*/launch.h)

while IFS= read -r hit; do
  file=${hit%%:*}
  rest=${hit#*:}
  where="$file:${rest%%:*}"
  inc=$(sed -E 's/^[^"]*"([^"]+)".*/\1/' <<<"${rest#*:}")
  case "/$inc/" in
    */../*) violation "$where" "\"$inc\" climbs out of its root"; continue ;;
  esac
  case "$file" in
    kernels/*/launch.h)
      case "$inc" in
        headloss.h | hl/*) ;;
        *) violation "$where" "the contract includes \"$inc\" (standard headers, headloss.h and hl/ only)" ;;
      esac ;;
    src/*)
      if [[ "$inc" == kernels/* ]]; then
        [[ "$inc" =~ ^kernels/[A-Za-z0-9_]+/launch\.h$ && -e "$inc" ]] ||
          violation "$where" "src/ reaches kernels/ only through kernels/<op>/launch.h, not \"$inc\""
      elif ! found "$file" "$inc" src common include; then
        violation "$where" "\"$inc\" is not in src/, common/ or include/"
      fi ;;
    kernels/*)
      found "$file" "$inc" kernels common include ||
        violation "$where" "\"$inc\" is not in kernels/, common/ or include/ (kernels/ reaches src/ never)" ;;
    common/*)
      found "$file" "$inc" common include ||
        violation "$where" "\"$inc\" is not in common/ or include/ (common/ stands on neither side)" ;;
  esac
done < <(grep -rnE '^\s*#\s*include\s*"' src kernels common --exclude-dir=jax \
           --include='*.h' --include='*.cuh' --include='*.cpp' --include='*.cu' --include='*.cc')

if [ "$bad" = 0 ]; then
  echo "layers: every include of src/, kernels/ and common/ follows the rule"
fi
exit "$bad"
