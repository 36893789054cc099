"""Tuning: record real traffic (``serve --record``), replay it against a candidate policy
(``extauthz simulate``) and see who would be refused. See docs/tuning.md."""
