"""The accuracy table of runs/accuracy: its plan (rows x scopes), the sweep that runs the
missing `flexgen-helm eval` records, and the report built from them."""
