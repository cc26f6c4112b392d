"""The inspection commands: `pgs profile` (memory prediction) and `pgs report` (plots)."""
