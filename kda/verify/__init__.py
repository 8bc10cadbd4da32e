"""Verification: backends against the float64 reference (see docs/design.md).

`cases` draws the inputs, `check` runs and compares one case or case class, `records` keeps the
outcomes under a fingerprint of everything that can change the numbers, `cli` is ``python -m kda.verify``.
"""

from kda.verify.cases import VerificationCase, cases_for, full_grid, make_inputs
from kda.verify.check import CaseResult, ClassResult, relative_error, run_case, tolerance, verify_class
from kda.verify.records import Record, RecordStore, default_store, fingerprint

__all__ = [
    "CaseResult",
    "ClassResult",
    "Record",
    "RecordStore",
    "VerificationCase",
    "cases_for",
    "default_store",
    "fingerprint",
    "full_grid",
    "make_inputs",
    "relative_error",
    "run_case",
    "tolerance",
    "verify_class",
]
