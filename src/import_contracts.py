"""An import-linter contract type of the project's own (not shipped: lint-imports loads it from src/).

`type = "import_contracts.OnlyTheseExternals"`: the modules under `source_modules` import no module
outside their own root package but the standard library and `allowed_modules` (another root
package of the session, `harness` say, counts as outside); `ignore_imports` lists the
allowed exceptions, each with its reason beside it in pyproject.toml.
"""

from __future__ import annotations

import sys
from typing import Any

from importlinter import Contract, ContractCheck, fields, output
from importlinter.domain.imports import Module


class OnlyTheseExternals(Contract):
    """The source modules import only the standard library, their own root package and `allowed_modules`."""

    source_modules = fields.ListField(subfield=fields.ModuleField())
    allowed_modules = fields.ListField(subfield=fields.StringField(), required=False)
    ignore_imports = fields.ListField(subfield=fields.StringField(), required=False)

    def check(self, graph: Any, verbose: bool) -> ContractCheck:
        """Every direct import of a source module (or its descendants) whose top-level package is
        neither the source's own root package, the standard library nor allowed, and not ignored."""
        # The fields are read through `contract_options` (the class attributes are descriptors).
        options = self.contract_options
        allowed = set(options.get("allowed_modules", []))
        ignored = {
            tuple(part.strip() for part in line.split("->")) for line in options.get("ignore_imports", [])
        }
        broken: list[tuple[str, str, list[int]]] = []
        for name in options["source_modules"]:
            source = Module(name)
            own_root = name.split(".")[0]
            importers = {source.name, *graph.find_descendants(source.name)}
            for importer in sorted(importers):
                for imported in sorted(graph.find_modules_directly_imported_by(importer)):
                    top = imported.split(".")[0]
                    if top == own_root or top in sys.stdlib_module_names or top in allowed:
                        continue
                    if (importer, top) in ignored:
                        continue
                    lines = graph.get_import_details(importer=importer, imported=imported)
                    broken.append((importer, imported, [d["line_number"] for d in lines]))
        return ContractCheck(kept=not broken, metadata={"broken": broken})

    def render_broken_contract(self, check: ContractCheck) -> None:
        """Each forbidden import, by importer and line."""
        for importer, imported, lines in check.metadata["broken"]:
            output.print_error(f"{importer} imports {imported} (l. {', '.join(map(str, lines))})")
            output.new_line()
