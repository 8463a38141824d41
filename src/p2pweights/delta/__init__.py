"""Delta updates: send only the bytes that changed since the previous update.

``wire`` is the payload one engine rank receives in its scratch region, ``apply`` the
engine side that checks and applies it, ``store`` the sender's copy of the previous
update's bytes and which engine ranks hold them.
"""
