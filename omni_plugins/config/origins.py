"""Where each value of a loaded pipeline was written: file, line and path as the user wrote them.

Two layers lie between the data pydantic validates and the files:

- a layout translation (a vLLM-Omni file read into omni-plugins' fields) moves values: ``moves``
  maps a location of the validated data to the location it was read from in the merged document;
- overlays (``base_config``) merge several files into that document: ``files`` maps a location of
  the merged document to the file and the location in it that provided the value.

Both are prefix maps: the longest recorded prefix of a location decides, the rest of the path is
carried along. A location no prefix covers is where it is, in the main file.
"""

from __future__ import annotations

from collections.abc import Mapping

from omni_plugins.config.yamldoc import Loc, YamlDoc, format_loc


def through(prefixes: Mapping[Loc, Loc], loc: Loc) -> Loc:
    """``loc`` mapped by the longest prefix of it in ``prefixes`` (unchanged when none is)."""
    for n in range(len(loc), -1, -1):
        hit = prefixes.get(loc[:n])
        if hit is not None:
            return (*hit, *loc[n:])
    return loc


class Origins:
    """Maps locations of the validated data back to the files (see the module docstring)."""

    def __init__(self, main: YamlDoc) -> None:
        self.main = main
        #: merged-document prefix -> (file, prefix in that file); set when overlays were merged
        self.files: dict[Loc, tuple[YamlDoc, Loc]] = {}
        #: validated-data prefix -> merged-document prefix; set by a layout translation
        self.moves: dict[Loc, Loc] = {}

    def source(self, loc: Loc) -> tuple[YamlDoc, Loc]:
        """The file and the location in it where ``loc`` (a location of the validated data) was written."""
        return self.merged_source(through(self.moves, loc))

    def merged_source(self, merged: Loc) -> tuple[YamlDoc, Loc]:
        """The file and the location in it of a location of the merged document."""
        for n in range(len(merged), -1, -1):
            hit = self.files.get(merged[:n])
            if hit is not None:
                doc, prefix = hit
                return doc, (*prefix, *merged[n:])
        return self.main, merged

    def where(self, loc: Loc) -> str:
        """``file:line: path`` as written."""
        doc, at = self.source(loc)
        return doc.where(at)

    def merged_where(self, loc: Loc) -> str:
        """``file:line: path`` of a location of the merged document."""
        doc, at = self.merged_source(loc)
        return doc.where(at)

    def line(self, loc: Loc) -> tuple[str, int | None]:
        """``(file, line)`` of ``loc``."""
        doc, at = self.source(loc)
        return doc.filename, doc.line_of(at)

    def path(self, loc: Loc) -> str:
        """The path of ``loc`` as written (``stage_args[0] (stage 0).engine_args.worker_type``)."""
        doc, at = self.source(loc)
        return format_loc(at, doc.data)
