"""The background launches of tests/background.py run at the lowest CPU priority, their workers too."""

from __future__ import annotations

import contextvars
import os
import sys

import background

# what a launch's worker says: its nice value and its session's (autogroup) nice, 19 where Linux has no autogroups
WORKER = ("import os; path = '/proc/self/autogroup'; "
          "print(os.nice(0), open(path).read().split()[-1] if os.path.exists(path) else 19)")
# a launcher starting the worker in a session of its own, as torchrun does
LAUNCHER = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {WORKER!r}], start_new_session=True)"


def test_a_background_launch_runs_its_workers_sessions_at_the_lowest_priority(tmp_path):
    def launch(folder):
        return background.run([sys.executable, "-c", LAUNCHER], 60)

    result = contextvars.copy_context().run(background._run_in_background, launch, tmp_path)
    assert result.returncode == 0 and result.stdout.split() == ["19", "19"], result
    foreground = background.run([sys.executable, "-c", LAUNCHER], 60)  # outside: as the test's own
    assert foreground.stdout.split()[0] == str(os.nice(0)), foreground
