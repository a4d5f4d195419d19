def main():
    print("workbench")
