"""Getting, checking and building IN-9 test data (see docs/data.md). fetch resumes a partial download and extracts
into --data-path (<data-path>/original/val/...); build follows the paper's Appendix A (resize 256, centre crop
224, four filters, GrabCut masks)."""
