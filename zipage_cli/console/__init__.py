"""The terminal console: `zipage chat` (Textual and line mode) and `zipage top`, their widgets, key
handling and themes. It holds an engine through the front-door protocol, local or attached.
"""
