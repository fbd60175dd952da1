"""Getting, checking and building IN-9 test data: `python -m tools.data {fetch,verify,build,provenance,cache}`.

fetch   downloads the release archive (resuming a partial download), checks its SHA-256 and extracts it
        safely into --data-path, so that <data-path>/original/val/... exist.
verify  checks the folder layout both scripts read and prints a variation x class table of counts and
        every problem found; `quick_check` is the fast form the scripts run before they start.
build   makes the eight variations and fg_mask from labelled images with one bounding box each,
        following the paper's Appendix A (resize 256, centre crop 224, four filters, GrabCut masks).
provenance  finds the only_bg_t image each mixed image was made from, and every mask's box, from the pixels.
cache   shows what the decoded-data cache holds, and clears it, bounds its size or removes what this
        version cannot read."""
