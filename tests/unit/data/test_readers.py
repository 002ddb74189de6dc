"""The readers' registry (onegpu.data.readers): one reader per format check_input can return."""
from __future__ import annotations

from onegpu.data import base, formats, readers


def test_every_format_has_one_reader_with_its_columns_and_drop_reasons():
    assert set(readers.READERS) == set(formats.COLUMNS)
    for fmt, reader in readers.READERS.items():
        assert isinstance(reader, base.Reader) and readers.reader(fmt) is reader and reader.format == fmt
        assert reader.columns == formats.COLUMNS[fmt] and reader.drop_reasons == formats.DROP_REASONS[fmt]
        assert "duplicate" in reader.drop_reasons
