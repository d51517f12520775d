"""Imported when it starts by every Python process of a background launch (tests/background.py puts this folder first
on their PYTHONPATH). torchrun starts each worker in a session of its own, which Linux schedules by itself at normal
priority however low the launch's: this puts each process back at the lowest, as scripts/lowest_priority.sh puts the
launch. Its plain nice 19 the processes inherit."""

try:
    with open("/proc/self/autogroup", "w") as autogroup:
        autogroup.write("19")
except OSError:  # no scheduling by session here: the inherited nice is what counts
    pass
