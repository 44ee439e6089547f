// How tsctl shows what each job's optimizer is doing (JobStatus::Activity): the activity table of
// `tsctl top` and the "activity" object of `tsctl jobs --json`. Kept apart from tsctl.cc so the
// formatting can be read (and changed) in one place.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tsd/client.h"

namespace tsd::tsctl {

// The table's header and one row per job, in the order given. A job without an optimizer shows
// dashes; so do the client-reported columns (WAIT, H2D/STEP, D2H/STEP) until its client reports.
std::vector<std::string> ActivityTable(const std::vector<JobStatus>& jobs);

// The job's activity as JSON (null when it has no optimizer); stable keys: steps, params,
// params_updated, bucket_updates, steps_per_s, params_per_s, bucket_update_p50_s,
// bucket_update_p99_s, moment_dtype, client_reports, step_wait_s, h2d_bytes_per_step,
// d2h_bytes_per_step (the last three null until the client reports).
nlohmann::json ActivityJson(const JobStatus& job);

// "850us", "12.5ms", "1.20s"; "0" for zero.
std::string FormatSeconds(double s);
// "950", "12.3K", "4.56M", "7.89G".
std::string FormatCount(double n);

}  // namespace tsd::tsctl
