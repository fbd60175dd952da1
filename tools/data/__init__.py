"""Getting, checking and building IN-9 test data: `python -m tools.data {fetch,verify,build}`.

fetch   downloads the release archive (resuming a partial download), checks its SHA-256 and extracts it
        safely into --data-path, so that <data-path>/original/val/... exist.
verify  checks the folder layout both scripts read and prints a variation x class table of counts and
        every problem found; `quick_check` is the fast form the scripts run before they start.
build   makes the eight variations and fg_mask from labelled images with one bounding box each,
        following the paper's Appendix A (resize 256, centre crop 224, four filters, GrabCut masks)."""

# The package: `download` (fetch), `check` (verify_layout, quick_check), `builder` (build), `cli`.

from tools.data.builder import SUMMARY_NAME, BuildResult, build
from tools.data.check import VerifyReport, quick_check, verify_layout
from tools.data.download import ARCHIVE_NAME, BAD_SUFFIX, PART_SUFFIX, RELEASE_SHA256, RELEASE_SIZE, RELEASE_URL, fetch
from tools.layout import MIXED

__all__ = ["ARCHIVE_NAME", "BAD_SUFFIX", "MIXED", "PART_SUFFIX", "RELEASE_SHA256", "RELEASE_SIZE", "RELEASE_URL",
           "SUMMARY_NAME", "BuildResult", "VerifyReport", "build", "fetch", "quick_check", "verify_layout"]
