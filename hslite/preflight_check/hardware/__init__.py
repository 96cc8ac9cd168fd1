"""The devices and the links between them: measured on this box, or stated in a bundled or own profile."""
