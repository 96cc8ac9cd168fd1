"""The scenes: registered benchmark scenes and a team's own cube, fetched, read and written (.mat, ENVI, GeoTIFF)."""
