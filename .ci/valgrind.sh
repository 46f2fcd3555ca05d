#!/usr/bin/env bash
# Valgrind memcheck over the CPU test binaries: the unit tests of both crates and every
# integration test, except trybuild's `ui` test (it runs cargo and rustc itself). Any memory
# error or definitely lost block fails the run. Extra arguments go to `cargo test --no-run`.
#
# The property tests and the stress test run with small sizes here (valgrind runs code 20 to
# 50 times slower); set PROPTEST_CASES or GPUCACHE_STRESS_OPS to override. Tests of safe,
# compute-heavy code are left to the plain run (`cargo test`): the planner's own unit tests
# (`planner::tests::`: `planner.rs` has no unsafe code, and its tests took 230 of the unit
# binary's 263 seconds under valgrind), planning the PyTorch logs' steps
# (`plan::plans_fit_the_real_models_steps`, the planner alone) and replaying the logs under every
# configuration (`replay_logs`, the allocator paths the other tests take, minutes under valgrind).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

missing=()
command -v valgrind >/dev/null || missing+=(valgrind)
command -v jq >/dev/null || missing+=(jq)
if ((${#missing[@]})); then
    sudo=()
    [[ $(id -u) == 0 ]] || sudo=(sudo)
    "${sudo[@]}" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq "${missing[@]}"
fi

# 6 random programs per property (16 took 4.5 minutes of the free-list programs alone on the
# 2-core machine): the plain run tries hundreds; here they look for memory errors on the paths
# the deterministic tests take too.
export PROPTEST_CASES="${PROPTEST_CASES:-6}"
export GPUCACHE_STRESS_OPS="${GPUCACHE_STRESS_OPS:-2000}"

json=$(cargo test --workspace --no-run --message-format=json "$@")
# "package directory<TAB>executable" for every test executable but `ui`.
mapfile -t tests < <(jq -r '
    select(.reason == "compiler-artifact" and .profile.test and .executable != null
           and .target.name != "ui")
    | "\(.manifest_path | rtrimstr("/Cargo.toml"))\t\(.executable)"' <<<"$json")
if ((${#tests[@]} == 0)); then
    echo "valgrind.sh: no test executables found" >&2
    exit 1
fi

# Proc-macro crates' test binaries link the standard library dynamically; `cargo test` puts
# its directory on the library path, so do the same.
export LD_LIBRARY_PATH="$(rustc --print target-libdir)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

suppressions=()
if [[ -f .ci/valgrind.supp ]]; then
    suppressions=(--suppressions="$PWD/.ci/valgrind.supp")
fi

# Valgrind runs a process's threads one at a time, so a test binary takes one core: a binary of
# many tests is split into as many shards as the machine has cores (its tests dealt round in
# order of name), each a valgrind process of its own, run side by side.
# The tests left to the plain run (above), by a part of their names, as `--skip` takes them.
skipped=(planner::tests:: plan::plans_fit_the_real_models_steps replay_logs)
skips=() unlisted=()
for s in "${skipped[@]}"; do
    skips+=(--skip "$s")
    unlisted+=(-e "$s")
done
shards=$(nproc 2>/dev/null || echo 1)
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT

# Runs test binary $2 under memcheck from directory $1, with the test harness's arguments after.
memcheck() {
    local dir=$1 bin=$2
    shift 2
    # Run from the package directory, as `cargo test` does.
    # --fair-sched: valgrind runs one thread at a time, and its default lock lets a thread that
    # loops without blocking starve the others for minutes.
    (cd "$dir" && valgrind --tool=memcheck --fair-sched=yes --error-exitcode=1 --leak-check=full \
        --show-leak-kinds=definite --errors-for-leak-kinds=definite \
        "${suppressions[@]}" "$bin" --quiet "${skips[@]}" "$@")
}

failed=()
for entry in "${tests[@]}"; do
    dir=${entry%%$'\t'*}
    bin=${entry#*$'\t'}
    name=$(basename "$bin")
    echo "=== valgrind memcheck: ${name%-*}"
    # The tests to run, the skipped ones left out here too (`--exact` names them whole).
    mapfile -t names < <("$bin" --list --format terse 2>/dev/null | sed -n 's/: test$//p' |
        grep -v -F "${unlisted[@]}" || true)
    if ((shards < 2 || ${#names[@]} < 40)); then
        memcheck "$dir" "$bin" || failed+=("${name%-*}")
        continue
    fi
    pids=()
    for ((k = 0; k < shards; k++)); do
        shard=()
        for ((i = k; i < ${#names[@]}; i += shards)); do
            shard+=("${names[i]}")
        done
        memcheck "$dir" "$bin" --exact "${shard[@]}" >"$logs/$k" 2>&1 &
        pids+=($!)
    done
    for ((k = 0; k < shards; k++)); do
        status=0
        wait "${pids[k]}" || status=$?
        echo "--- shard $((k + 1)) of $shards"
        cat "$logs/$k"
        ((status == 0)) || failed+=("${name%-*} (shard $((k + 1)))")
    done
done

if ((${#failed[@]})); then
    echo "valgrind.sh: memory errors, leaks or test failures in: ${failed[*]}" >&2
    exit 1
fi
echo "valgrind.sh: ${#tests[@]} test binaries clean under memcheck"
