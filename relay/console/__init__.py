"""The web console for support and compliance (design.md §6.9): a message's history, in-doubt
review and resolution, stats and the ledger's CSV export, behind a sign-in."""
