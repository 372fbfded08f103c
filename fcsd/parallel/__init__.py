"""Everything distributed lives here (design §1): model code stays single-device."""
