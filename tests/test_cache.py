"""The user-wide JSON cache is shared by every run on the machine: writers that meet must not fail or mix entries."""

import threading

from hslite.cache import cache_file, read_cache, write_cache


def test_runs_that_write_one_record_at_once_both_succeed_and_leave_one_whole_entry(own_cache):
    """Two runs started together measure the same loop and store it under one key (a fixed temporary name had the
    second rename find the first had already moved the file, and that run died)."""
    key, writers, rounds = {"plan": "same"}, 4, 100
    start, failures = threading.Barrier(writers), []

    def write(writer: int) -> None:
        start.wait()
        for step in range(rounds):
            try:
                write_cache("overhead", key, {"writer": writer, "step": step})
            except OSError as error:
                failures.append(error)

    threads = [threading.Thread(target=write, args=(w,)) for w in range(writers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    entry = read_cache("overhead", key)
    assert entry is not None and entry["step"] == rounds - 1  # every writer's last entry is its last step
    assert [path.name for path in cache_file("overhead", key).parent.iterdir()] == [cache_file("overhead", key).name]
