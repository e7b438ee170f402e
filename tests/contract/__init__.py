"""Contract suites: the same tests run against every store backend and every publisher."""
