package mps_test

import (
	"regexp"
	"testing"

	"github.com/gpufrac/gpufrac/pkg/node/mps"
	"github.com/gpufrac/gpufrac/pkg/node/nodeapi"
)

func TestParseClients(t *testing.T) {
	out := "PID,SERVER,DEVICE,NS,CMD\n3167082,gpufrac,GPU-cc97390c,gpufrac/gf_main_0123 (0),VLLM::EngineCore\n" +
		"12,gpufrac,GPU-cc97390c,gpufrac/default (1),python\n-4,x,y,x/z (0),bad\n5,short\n"
	got := mps.ParseClients(out)
	want := []mps.Client{{PID: 3167082, Server: "gpufrac", Namespace: "gf_main_0123"}, {PID: 12, Server: "gpufrac", Namespace: "default"}}
	if len(got) != len(want) || got[0] != want[0] || got[1] != want[1] {
		t.Errorf("ParseClients = %+v, want %+v", got, want)
	}
}

// Whatever the daemon prints, the parser returns only clients with a
// positive PID, and never panics.
func FuzzParseClients(f *testing.F) {
	f.Add("3167082,srv,GPU-cc97390c,srv/default (0),VLLM::EngineCore\n")
	f.Add("1,a,b,c\n,,,\n\x00,\n")
	f.Fuzz(func(t *testing.T, out string) {
		for _, c := range mps.ParseClients(out) {
			if c.PID <= 0 {
				t.Fatalf("client with PID %d from %q", c.PID, out)
			}
		}
	})
}

var namespaceRE = regexp.MustCompile(`^gf_[a-z0-9_]{0,16}_[0-9a-f]{20}$`)

// Any pod UID and container name give a namespace name the daemon
// accepts, and a control socket path short enough, under the default root.
func FuzzNamespaceName(f *testing.F) {
	f.Add("3f0e-uid", "main")
	f.Add("", "")
	f.Add("uid", "Ünïcode.Container-Name_with/slashes and spaces")
	f.Fuzz(func(t *testing.T, uid, container string) {
		name := nodeapi.NamespaceName(uid, container)
		if !namespaceRE.MatchString(name) {
			t.Fatalf("NamespaceName(%q, %q) = %q", uid, container, name)
		}
		if sock := nodeapi.NamespaceDir("/run/gpufrac/mps", name) + "/control"; len(sock) > 83 {
			t.Fatalf("socket path %s is %d characters", sock, len(sock))
		}
		if again := nodeapi.NamespaceName(uid, container); again != name {
			t.Fatalf("NamespaceName(%q, %q) gave %q, then %q", uid, container, name, again)
		}
	})
}

func FuzzDriverMajor(f *testing.F) {
	f.Add("615.10.02")
	f.Add("")
	f.Add("-1.2")
	f.Fuzz(func(t *testing.T, v string) {
		if m, err := mps.DriverMajor(v); err == nil && m <= 0 {
			t.Fatalf("DriverMajor(%q) = %d with no error", v, m)
		}
	})
}
