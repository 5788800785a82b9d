# Helpers for one batched device command (source it from a call script at the repo root; see s35a.sh).
# Set before sourcing: R (results dir under /tmp), LIMIT (seconds the stages may use). Gives:
#   pk            pack R into $OUT/<name of R>.tgz (after every stage: what ran comes back if the call is cut off)
#   left          seconds left of LIMIT
#   mk NAME ARCH FMT [ENV=V ...]   monokernel_bench (median of 3) with the env vars; $XA adds bench arguments,
#                 $MKT caps its seconds (default 75);
#                 prints tok/s, % of the probe and the first tokens (A/Bs that keep the math must match)
#   gt NAME SECS -k EXPR [pytest args]   the GPU-marked tests of $T (KIE_GPU_TESTS=1) into $R/test-NAME.log, SIGINT
#                 at SECS so pytest still prints what ran; prints the PASSED count and the first failures
# and runs scripts/gpu-check's env stage (versions, read probe, the carried wheels into /tmp/site).
mkdir -p "$R"; T0=$(date +%s)
pk() { tar czf "$OUT/$(basename "$R").tgz" -C "$(dirname "$R")" "$(basename "$R")"; echo "[t=$(( $(date +%s) - T0 ))s] packed"; }
left() { echo $(( LIMIT - ($(date +%s) - T0) )); }
mk() {
  local n=$1 a=$2 f=$3 t; shift 3; t=$(left); [ "$t" -gt 35 ] || { echo "skip $n"; return; }; [ "$t" -gt "${MKT:-75}" ] && t=${MKT:-75}
  env "$@" timeout "$t" python3 benchmarks/monokernel_bench.py --archs "$a" --formats "$f" --no-breakdown --reps 3 $XA \
    --out "$R/mk-$n.json" >"$R/mk-$n.log" 2>&1; echo "$n rc=$?"
  grep -o '"tok_per_s": [0-9.]*\|"pct_of_probe": [0-9.]*\|"tokens_sample": [^]]*' "$R/mk-$n.log" | tr '\n' ' '; echo; pk; }
gt() {
  local n=$1 t=$2; shift 2
  KIE_GPU_TESTS=1 timeout -s INT "$t" python3 -m pytest $T -q --tb=short -rA -p no:cacheprovider -o addopts="" -m gpu "$@" \
    >"$R/test-$n.log" 2>&1; echo "$n tests rc=$?"
  grep -cE "^PASSED" "$R/test-$n.log"; grep -E "^(FAILED|ERROR)" "$R/test-$n.log" | head -8 | cut -c1-200; pk; }
scripts/gpu-check "$R" env >/dev/null 2>&1; tail -1 "$R/env.log" | cut -c1-160; export PYTHONPATH=/tmp/site
