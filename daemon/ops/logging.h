// Sets up spdlog: one line per event with key=value fields, on stderr, in one of two formats.
//
// Under systemd, stderr is a stream to journald (systemd sets JOURNAL_STREAM to that stream's
// device and inode). There each line starts with a syslog priority, "<6>info event=...", which
// journald turns into the entry's priority and strips, and carries no timestamp of its own:
// journald stamps every entry. Anywhere else (a terminal, a file, a test) lines start with an
// ISO-8601 local timestamp and the level, coloured on a terminal.
#pragma once

#include <string>

namespace tsd {

// True when stderr is the stream JOURNAL_STREAM names (not merely when the variable is set: a
// child of a service that redirected stderr to a file inherits the variable but not the stream).
bool StderrIsJournal();

// Creates the "tsd" logger in the format above and makes it the default. `level` is one of
// trace, debug, info, warn, error, critical, off (LoadConfig has checked it). libprotobuf's own log
// lines (a client's string that is not UTF-8, say) go to it too, at debug, in the same format.
void SetupLogging(const std::string& level);

// Changes the level of the running logger (a reload). Same names as SetupLogging.
void SetLogLevel(const std::string& level);

}  // namespace tsd
