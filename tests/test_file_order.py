from pathlib import Path

import pytest

from tests.file_order import durations_from_junit, load_durations, longest_files_first

ROOT = Path(__file__).resolve().parents[1]


class _Item:
    def __init__(self, nodeid: str, *markers: str) -> None:
        self.nodeid = nodeid
        self._markers = set(markers)

    def get_closest_marker(self, name: str) -> object | None:
        return name if name in self._markers else None


def _files(items: list[_Item]) -> list[str]:
    return [i.nodeid for i in items]


def test_a_long_file_of_few_tests_goes_before_a_short_file_of_many() -> None:
    many = [_Item(f"tests/a/test_many.py::test_{n}") for n in range(30)]
    few = [_Item("tests/z/test_few.py::test_one"), _Item("tests/z/test_few.py::test_two")]
    ordered = longest_files_first(many + few, {"tests/z/test_few.py": 300.0, "tests/a/test_many.py": 6.0})
    assert _files(ordered) == _files(few) + _files(many)


def test_an_unlisted_file_is_estimated_from_its_markers_and_keeps_its_own_order() -> None:
    plain = [_Item(f"tests/test_plain.py::test_{n}") for n in range(10)]
    slow = [_Item("tests/test_slow.py::test_b", "slow"), _Item("tests/test_slow.py::test_a", "slow")]
    ordered = longest_files_first(plain + slow, {})
    assert _files(ordered) == _files(slow) + _files(plain)


def test_junit_times_are_summed_per_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # file names resolve against the checkout, not the working folder
    junit = tmp_path / "junit.xml"
    junit.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_layout" name="test_a" time="1.25"/>'
        '<testcase classname="tests.test_layout" name="test_b" time="2.0"/>'
        '<testcase classname="tests.test_file_order._Suite" name="test_c" time="0.5"/>'
        '<testcase classname="gone.test_elsewhere" name="test_d" time="9"/>'
        "</testsuite></testsuites>"
    )
    assert durations_from_junit(junit) == {"tests/test_file_order.py": 0.5, "tests/test_layout.py": 3.2}


def test_the_committed_durations_name_files_that_exist() -> None:
    durations = load_durations()
    assert durations, "tests/file_durations.json is missing or empty"
    missing = [path for path in durations if not (ROOT / path).exists()]
    assert not missing, f"tests/file_durations.json lists files that are gone: {missing}"
