package integration

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
)

// BenchmarkNodeAgentRSS runs the real gpufrac binary ($GPUFRAC_BIN, built
// by `make bench-node`) as a node agent with 8 simulated H100s against the
// API server, resyncing every second, and reports its resident memory
// after 15 s of steady state. Run with -benchtime 1x.
func BenchmarkNodeAgentRSS(b *testing.B) {
	bin := os.Getenv("GPUFRAC_BIN")
	if bin == "" {
		b.Fatal("GPUFRAC_BIN must name the gpufrac binary (make bench-node sets it)")
	}
	dir := b.TempDir()
	kubeconfig := filepath.Join(dir, "kubeconfig")
	cfg := shared.adminConfig
	kc := clientcmdapi.NewConfig()
	kc.Clusters["test"] = &clientcmdapi.Cluster{Server: cfg.Host, CertificateAuthorityData: cfg.CAData}
	kc.AuthInfos["admin"] = &clientcmdapi.AuthInfo{ClientCertificateData: cfg.CertData, ClientKeyData: cfg.KeyData}
	kc.Contexts["test"] = &clientcmdapi.Context{Cluster: "test", AuthInfo: "admin"}
	kc.CurrentContext = "test"
	if err := clientcmd.WriteToFile(*kc, kubeconfig); err != nil {
		b.Fatal(err)
	}
	for i := 0; b.Loop(); i++ {
		node := fmt.Sprintf("rss-node-%d-%d", time.Now().UnixNano(), i)
		if _, err := shared.admin.CoreV1().Nodes().Create(context.Background(), &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: node}}, metav1.CreateOptions{}); err != nil {
			b.Fatal(err)
		}
		cmd := exec.Command(bin, "node-agent", "--node-name", node, "--kubeconfig", kubeconfig, "--simulate-gpus", "dgxh100",
			"--state-dir", filepath.Join(dir, node), "--resync-period", "1s", "--health-addr", "", "--reservation-namespace", "default")
		if err := cmd.Start(); err != nil {
			b.Fatal(err)
		}
		time.Sleep(15 * time.Second)
		rss, err := rssKiB(cmd.Process.Pid)
		_ = cmd.Process.Signal(os.Interrupt)
		_ = cmd.Wait()
		if err != nil {
			b.Fatal(err)
		}
		b.ReportMetric(float64(rss)/1024, "rss-MiB")
	}
}

func rssKiB(pid int) (int, error) {
	status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(string(status), "\n") {
		if rest, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			return strconv.Atoi(strings.TrimSuffix(strings.TrimSpace(rest), " kB"))
		}
	}
	return 0, fmt.Errorf("no VmRSS for pid %d", pid)
}
