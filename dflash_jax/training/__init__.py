"""Training: DFlash drafts on a frozen target, tiny targets, and their token data."""
