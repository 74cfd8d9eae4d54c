package api

import (
	"strings"
	"testing"
)

func TestSharesHeldRoundTripsAndRefusesBadValues(t *testing.T) {
	h := SharesHeld{MemoryMiB: 20480, Mode: SMSharing, Portion: 250}
	got, err := ParseSharesHeld(h.String())
	if err != nil || got != h {
		t.Fatalf("round trip of %s: %+v, %v", h, got, err)
	}
	for raw, want := range map[string]string{
		`{"memoryMiB":-1}`:                                  "at least 0",
		`{"memoryMiB":1,"mode":"mig"}`:                      "mode must be",
		`{"memoryMiB":1,"mode":"time-slicing","portion":5}`: "no compute portion",
		`{"memoryMiB":1,"extra":1}`:                         "unknown field",
		`{"memoryMiB":1}{}`:                                 "one JSON object",
		`{"memoryMiB":1,"portion":1001}`:                    "portion from 0 to 1000",
	} {
		if _, err := ParseSharesHeld(raw); err == nil || !strings.Contains(err.Error(), want) || !strings.Contains(err.Error(), SharesHeldAnnotation) {
			t.Errorf("ParseSharesHeld(%s) = %v, want an error naming the annotation and %q", raw, err, want)
		}
	}
}

func TestDRADeviceNamesKeepTheGPU(t *testing.T) {
	uuid := "GPU-1aa8b167-eaf1-42c1-a7b0-7f032e5c3233"
	name, ok := DRADeviceName(uuid, SMSharing)
	if !ok || name != "gpu-1aa8b167-eaf1-42c1-a7b0-7f032e5c3233-sm-sharing" {
		t.Fatalf("DRADeviceName = %q, %v", name, ok)
	}
	u, mode, ok := ParseDRADevice(name)
	if !ok || !strings.EqualFold(u, uuid) || mode != SMSharing {
		t.Errorf("ParseDRADevice(%s) = %s, %s, %v", name, u, mode, ok)
	}
	for _, bad := range []string{"MIG-1aa8b167", "GPU-" + strings.Repeat("a", 60), "GPU_1"} {
		if _, ok := DRADeviceName(bad, TimeSlicing); ok {
			t.Errorf("DRADeviceName(%s) named a device", bad)
		}
	}
	if _, _, ok := ParseDRADevice("gpu-0"); ok {
		t.Error("a device name without a mode parsed")
	}
}
