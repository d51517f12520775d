#!/bin/sh
# Run a command at the lowest CPU priority that holds where Linux schedules by session (autogroup): plain nice only
# ranks a process against the others of its session, and torchrun starts each worker in a session of its own, so a
# nice-19 job in the caller's session still took a fair share of the CPU from a launch's workers (a launch test ran
# 14 % slower beside one). Start it in a session of its own (setsid, start_new_session=True): its group is then set to
# nice 19 as well. Used for the test suite's background work: the lane's setup, the CUDA compiles.
echo 19 >/proc/self/autogroup 2>/dev/null
exec nice -n 19 "$@"
