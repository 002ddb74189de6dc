"""How numbers and tables are written for people (onegpu.formatting): one format for bytes, times and
ratios everywhere, tables through tabulate."""
from __future__ import annotations

from onegpu import formatting as f
from tests.tables import cells


def test_bytes_times_and_ratios():
    assert f.mib(1727 * 2**20) == "1,727 MiB" and f.mib(1727 * 2**20, unit=False) == "1,727"
    assert f.gib(0.8 * 2**30) == "0.80 GiB" and f.ratio(1.234) == "1.23x" and f.num(2.25, ".1f") == "2.2"
    assert [f.mib(None), f.gib(None), f.ratio(None), f.num(None), f.mib(None, missing="?")] == ["-"] * 4 + ["?"]
    assert (f.sci(0.0), f.sci(float("inf")), f.sci(1.2345e-4), f.signed(0.02)) == ("0", "inf", "1.23e-04", "+0.0200")
    assert (f.seconds(0.6152), f.seconds(20.42), f.duration(27.4), f.duration(3000)) == (
        "0.615 s", "20.4 s", "27 s", "50.0 min")


def test_markdown_table_keeps_cells_as_given_and_escapes_pipes():
    lines = f.markdown_table(["run", "samples/s"], [["a|b", "0010"], ["c", "2.50"]]).splitlines()
    assert [cells(ln) for ln in (lines[0], lines[2], lines[3])] == [["run", "samples/s"], ["a\\|b", "0010"],
                                                                   ["c", "2.50"]]
    assert set(lines[1]) == {"|", "-"}


def test_text_table_indents_and_right_aligns_the_columns_asked_for():
    lines = f.text_table(("run", "peak MiB"), [("long-name", "5"), ("b", "1,234")], right=(1,))
    assert lines[0].startswith("  run") and lines[1].startswith("  ---")
    assert lines[2].endswith("    5") and lines[3].endswith("1,234")
    assert len({len(ln) for ln in lines}) == 1  # every line as wide as the table


def test_size_is_mib_below_a_gib_and_gib_from_it():
    from onegpu.formatting import size
    assert (size(512 * 2**20), size(2**30), size(1.5 * 2**30), size(None)) == ("512 MiB", "1.00 GiB", "1.50 GiB", "-")
