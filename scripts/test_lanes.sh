#!/usr/bin/env bash
# `make test`: the suite as two pytest processes side by side, one per core.
#
# An engine job alone keeps about 1.3 of two cores busy, so two lanes with one OpenMP thread each
# (threads that outnumber the cores spin-wait for each other) finish the suite in about two thirds
# of its time. Which modules run in lane 1 is named in tests/conftest.py (LANE_1); lane 0 runs
# the rest. Both lanes get the same pytest arguments, so a selection runs wherever its modules
# live. Lane 0 reports as it runs, lane 1's report follows; the exit status is the first failing
# lane's ("no tests collected" in one lane is not a failure). With fewer than two cores, or
# TEST_LANES=1, the suite runs in one process.
set -u
PY=${PY:-.venv/bin/python}
CORES=$("$PY" -c "import os; print(len(os.sched_getaffinity(0)))")
if [ "${TEST_LANES:-2}" -lt 2 ] || [ "$CORES" -lt 2 ]; then
    exec "$PY" -m pytest "$@"
fi
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
lane() {  # lane N PYTEST_ARGS...
    TEST_LANE=$1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "$PY" -m pytest --basetemp="$WORK/lane$1" "${@:2}"
}
lane 1 "$@" > "$WORK/lane1.log" 2>&1 &
LANE1=$!
lane 0 "$@"
RC0=$?
wait $LANE1
RC1=$?
echo "=============================== lane 1 ==============================="
cat "$WORK/lane1.log"
ok() { [ "$1" -eq 0 ] || [ "$1" -eq 5 ]; }  # 5: pytest collected no test in that lane
if ! ok $RC0; then exit $RC0; fi
if ! ok $RC1; then exit $RC1; fi
[ $RC0 -eq 5 ] && [ $RC1 -eq 5 ] && exit 5
exit 0
