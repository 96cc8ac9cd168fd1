"""`hslite compare`: plans side by side, predicted by the pre-flight and, on request, measured by short fits."""
